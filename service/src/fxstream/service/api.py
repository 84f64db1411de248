"""The REST API: users, functions, endpoints and task status (contract: docs/api.md).

The service keeps no state of its own. Every write is a record produced to a
compacted topic (keyed by id; a delete is a tombstone) with an idempotent,
``acks=all`` producer, and the handler answers only once the
:class:`~fxstream.service.registry.RegistryView` has folded that record, so a
read right after a write sees it. Every read comes from that view, which is
rebuilt from the topics at start: kill the service, start it again, and
nothing is lost.

Handlers are synchronous: FastAPI runs them in its thread pool, where waiting
for Kafka does not block the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from threading import Event, Thread
from typing import Annotated, Any, Literal

import msgspec
from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from fxstream.service.accounts import AccountError, AccountManager
from fxstream.service.accounts import Principal as KafkaPrincipal
from fxstream.service.analytics_view import AnalyticsView, summarize
from fxstream.service.auth import (
    DEFAULT_TOKEN_LIFETIME_S,
    MAX_ROTATION_GRACE_S,
    TokenCheck,
    check_user_token,
    digest_matches,
    endpoint_token_matches,
    may_use,
    new_token,
    token_expires_at,
    token_sha256,
)
from fxstream.service.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from fxstream.service.dashboard import dashboard_router
from fxstream.service.endpoint_logs import read_endpoint_logs
from fxstream.service.identity_provider import (
    IdentityProvider,
    IdentityProviderUnavailable,
    IdentityRejected,
)
from fxstream.service.memory_report import MemoryReport, report_interval_s, report_periodically
from fxstream.service.metrics import ApiMetrics, DeadLetterCounter, metrics_access
from fxstream.service.rate_limit import DEFAULT_LIMITS, RateLimiter, RegistrationLimits
from fxstream.service.registry import RegistryView
from fxstream.service.task_expiry import DEFAULT_RETENTION_S, retention_from_env
from fxstream.service.task_query import decode_cursor, encode_cursor, event_log, parse_tag
from fxstream.service.task_table import DEFAULT_MAX_SCAN, TaskQuery
from fxstream.topics import (
    Catalogue,
    DeserializationError,
    EndpointRecord,
    FunctionRecord,
    KafkaConnection,
    Record,
    RecordDecodeError,
    TaskState,
    TaskStateName,
    TriggerRule,
    UserRecord,
    client_info,
    code_sha256,
    decode,
    encode,
    producer_message_max_bytes,
    record_bytes,
    strategy_of,
)
from fxstream.topics.acls import SERVICE_GROUP_PREFIX
from fxstream.topics.records import LATEST_TIMESTAMP

__all__ = ["AccountSettings", "ApiError", "Principal", "RecordWriter", "create_app"]

log = logging.getLogger(__name__)

# The same id rule as the records (fxstream.topics.records), so nothing the API
# accepts is refused when the record is read back.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$"
MAX_STATUS_QUERY = 1_000
MAX_TASK_PAGE = 1_000
DEFAULT_TASK_PAGE = 100
MAX_QUERY_TAGS = 8
MAX_GROUP_PAGE = 1_000
# A page of a task group stops growing once its values reach this many bytes (a
# task-state value may be up to the topic's record limit); it always holds one task.
MAX_GROUP_PAGE_VALUE_BYTES = 8 * 1024 * 1024
MAX_SHARED_WITH = 10_000
# The trigger processor's consumer group (fxstream.service.processors: <app id>-trigger).
TRIGGER_GROUP = f"{SERVICE_GROUP_PREFIX}-trigger"
_TERMINAL_STATES = frozenset({"succeeded", "failed", "rejected", "cancelled"})
_TRIGGER_HELP = "see docs/triggers.md for a rule's fields"


class ApiError(Exception):
    """An error answered as ``{"error": code, "detail": detail}`` with ``status``."""

    def __init__(
        self, status: int, error: str, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers


# --- request and response bodies -----------------------------------------------------------

Id = Annotated[str, Field(pattern=ID_PATTERN, description="an id: 1-128 letters, digits, '-'")]
Name = Annotated[str, Field(min_length=1, max_length=256)]
Description = Annotated[str, Field(max_length=65_536)]
SharedWith = Annotated[
    list[Id],
    Field(max_length=MAX_SHARED_WITH, description="user ids that may use it besides the owner"),
]


def _strict_b64(value: object) -> bytes:
    # pydantic's Base64Bytes silently drops characters outside the alphabet; a code
    # payload that does not decode exactly is a client bug worth reporting.
    if not isinstance(value, str):
        raise ValueError("must be a standard base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"is not valid standard base64 ({exc})") from exc


def _fxstream_payload(code: bytes) -> bytes:
    # A strategy this service does not know is fine (the agents may), but bytes
    # without the payload header can never be loaded by anyone.
    try:
        strategy_of(code)
    except DeserializationError as exc:
        if exc.strategy is None:
            raise ValueError(
                f"{exc}; serialize the function with fxstream.topics.Serializer"
            ) from exc
    return code


CodePayload = Annotated[
    bytes,
    BeforeValidator(_strict_b64),
    AfterValidator(_fxstream_payload),
    WithJsonSchema(
        {
            "type": "string",
            "contentEncoding": "base64",
            "description": "the serialized function (fxstream payload header first), base64",
        }
    ),
]


class _Body(BaseModel):
    # A misspelt field ("allowed_user") must fail loudly, not be dropped.
    model_config = ConfigDict(extra="forbid")


class NewUser(_Body):
    """``POST /v1/users``."""

    name: Name


class UserCreated(BaseModel):
    """The new user's id and API token (shown only this once)."""

    user_id: str
    token: str
    token_expires_at: float = Field(description="when the token expires (Unix time)")
    kafka_username: str | None = Field(
        default=None, description="the user's own Kafka principal (null on an insecure platform)"
    )
    kafka_password: str | None = Field(
        default=None, description="its SCRAM-SHA-512 password, shown only now and stored nowhere"
    )


class NewToken(BaseModel):
    """A token issued by rotation, by the admin, or by a login (shown only this once)."""

    user_id: str
    token: str
    token_expires_at: float = Field(description="when the token expires (Unix time)")
    previous_token_valid_until: float | None = Field(
        default=None,
        description="until when the token rotated away still works; null: revoked at once",
    )


class Rotation(_Body):
    """``POST /v1/users/me/token``."""

    grace_s: Annotated[
        float,
        Field(
            ge=0,
            le=MAX_ROTATION_GRACE_S,
            description="how long the old token keeps working; 0 (default): revoked at once",
        ),
    ] = 0.0


class Login(_Body):
    """``POST /v1/login/{provider}``: a bearer token issued by the identity provider."""

    token: Annotated[str, Field(min_length=1, max_length=8192)]


class LoggedIn(NewToken):
    """A login's fxstream token; ``created`` is true when this login created the user."""

    created: bool
    kafka_username: str | None = Field(
        default=None, description="a new user's Kafka principal (null if not created now)"
    )
    kafka_password: str | None = Field(
        default=None, description="its SCRAM-SHA-512 password, shown only now and stored nowhere"
    )


class Me(BaseModel):
    """Who the caller's token belongs to."""

    user_id: str
    name: str
    token_expires_at: float | None = Field(
        default=None, description="when the token used for this call expires"
    )


Labels = Annotated[
    dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]],
    Field(max_length=256),
]
"""A function's or an endpoint's metadata: at most 256 labels, bounded keys and values."""


class NewFunction(_Body):
    """``POST /v1/functions``."""

    name: Name
    code: CodePayload
    container: Annotated[str, Field(max_length=1024)] | None = None
    public: bool = False
    allowed_users: SharedWith = []
    description: Description = ""
    metadata: Labels = {}


class FunctionCreated(BaseModel):
    """The new function's id and the SHA-256 of its code, computed by the service."""

    function_id: str
    code_sha256: str


class NewEndpoint(_Body):
    """``POST /v1/endpoints``."""

    name: Name
    public: bool = False
    allowed_users: SharedWith = []
    description: Description = ""
    metadata: Labels = {}


class EndpointCreated(BaseModel):
    """The new endpoint's id and its own API token (shown only this once).

    The token is the agent's credential: it may only fetch the code of functions
    of tasks routed to this endpoint and read this endpoint. It is never the
    owner's token. The queue topic exists when this is answered.
    """

    endpoint_id: str
    token: str
    kafka_username: str | None = Field(
        default=None, description="the endpoint's Kafka principal for its agents (null if insecure)"
    )
    kafka_password: str | None = Field(
        default=None, description="its SCRAM-SHA-512 password, shown only now and stored nowhere"
    )


class EndpointToken(BaseModel):
    """An endpoint's new token; the previous one stopped working at once."""

    endpoint_id: str
    token: str


class TaskIds(_Body):
    """``POST /v1/tasks/status``."""

    task_ids: Annotated[list[Id], Field(max_length=MAX_STATUS_QUERY)]


class TaskGroupPage(BaseModel):
    """``GET /v1/task-groups/{id}/tasks``: one page of the caller's tasks of a group."""

    task_group_id: str
    total: int = Field(description="how many of the caller's tasks the group has now")
    offset: int
    next_offset: int | None = Field(description="the offset of the next page; null at the end")
    tasks: list[dict[str, Any]] = Field(description="task-state records, as GET /v1/tasks/{id}")


class TaskPage(BaseModel):
    """``GET /v1/tasks``: one page of the caller's tasks that match the filters."""

    tasks: list[dict[str, Any]] = Field(description="task-state records, as GET /v1/tasks/{id}")
    next_cursor: str | None = Field(
        description="pass as cursor= for the next page; null once nothing further matches "
        "(a page may hold fewer tasks than limit, even none, and still have one)"
    )
    scanned: int = Field(description="index entries this page read (at most 10,000)")


AttributeValue = str | int | float | bool | None


class EventPredicateBody(_Body):
    """One condition on an event attribute (all of a rule's must hold)."""

    attribute: Annotated[str, Field(min_length=1, max_length=256)]
    op: Literal["eq", "ne", "prefix", "suffix", "glob", "lt", "le", "gt", "ge", "exists"]
    value: AttributeValue = None


class ClientBody(_Body):
    """The registering client's versions (the SDK sends its own)."""

    python_version: Annotated[str, Field(max_length=64)]
    fxstream_version: Annotated[str, Field(max_length=64)]
    serializers: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=64)]]


class NewTrigger(_Body):
    """``POST /v1/triggers``: a trigger rule owned by the caller (docs/triggers.md)."""

    name: Name
    source: Annotated[str, Field(pattern=ID_PATTERN, description="fires on events.<source>")]
    function_id: Id
    endpoint_id: Id
    endpoint_group: Annotated[list[Id], Field(max_length=16)] | None = None
    event_type: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    key_pattern: Annotated[
        str, Field(min_length=1, max_length=1024, description="fnmatch pattern on the event key")
    ] = "*"
    predicates: Annotated[list[EventPredicateBody], Field(max_length=32)] = []
    arguments: Literal["event", "attributes", "template"] = "event"
    template: Annotated[dict[str, str], Field(max_length=64)] = {}
    constants: Annotated[dict[str, AttributeValue], Field(max_length=64)] = {}
    paused: bool = False
    max_in_flight: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_per_second: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    client: ClientBody | None = None


class Version(BaseModel):
    """The service's version, and the oldest SDK and endpoint versions it works with."""

    api: Literal["v1"] = "v1"
    version: str
    min_sdk_version: str
    min_ep_version: str


class Health(BaseModel):
    """The service answers; ``kafka`` says whether the broker does too."""

    status: Literal["ok"] = "ok"
    kafka: bool


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: str
    detail: str


# --- the Kafka side: writing records and reading them back ---------------------------------


class RecordWriter:
    """Produces registry records and returns once the view has folded them.

    One idempotent ``acks=all`` producer, polled by a background thread that
    runs the delivery callbacks; handlers wait on a future per record.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        catalogue: Catalogue,
        view: RegistryView,
        *,
        timeout_s: float,
    ) -> None:
        self._catalogue = catalogue
        self._view = view
        self._timeout_s = timeout_s
        self._producer = Producer(
            {
                **kafka.confluent_producer(),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                "message.max.bytes": producer_message_max_bytes(catalogue),
                # Give up on a record when the handler gives up waiting for it.
                "message.timeout.ms": int(timeout_s * 1000),
                "logger": logging.getLogger("fxstream.service.kafka"),
            }
        )
        self._stop = Event()
        self._poller = Thread(target=self._poll, name="api-producer", daemon=True)

    def start(self) -> None:
        """Start serving delivery reports."""
        self._poller.start()

    def close(self) -> None:
        """Deliver what is pending (bounded by the timeout) and stop."""
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout=5)
        self._producer.flush(self._timeout_s)

    def put(self, topic: str, key: str, record: Record) -> None:
        """Write ``record`` under ``key`` and wait until reads see it."""
        value = encode(record)
        _check_readable(value, type(record))
        self._check_size(topic, key, value)
        self._write(topic, key, value)

    def delete(self, topic: str, key: str) -> None:
        """Write a tombstone for ``key`` and wait until reads no longer see it."""
        self._write(topic, key, None)

    def _write(self, topic: str, key: str, value: bytes | None) -> None:
        partition, offset = self._produce(topic, key, value)
        if not self._view.wait_for_offset(topic, partition, offset, self._timeout_s):
            raise ApiError(
                503,
                "not-yet-visible",
                f"the change was saved to Kafka ({topic} [{partition}] @ {offset}) but the "
                f"service has not read it back within {self._timeout_s:g}s; retry the read "
                "shortly",
            )

    def _produce(self, topic: str, key: str, value: bytes | None) -> tuple[int, int]:
        delivered: Future[tuple[int, int]] = Future()
        try:
            self._producer.produce(
                topic,
                key=key.encode(),
                value=value,
                on_delivery=lambda err, msg: _settle(delivered, err, msg),
            )
        except (BufferError, KafkaException) as exc:
            raise _kafka_unavailable(f"cannot write to {topic}: {exc}") from exc
        try:
            return delivered.result(timeout=self._timeout_s)
        except FutureTimeout as exc:
            raise _kafka_unavailable(
                f"Kafka did not acknowledge the write to {topic} within {self._timeout_s:g}s; "
                "it may or may not have been saved"
            ) from exc
        except KafkaException as exc:
            raise _kafka_unavailable(f"Kafka refused the write to {topic}: {exc}") from exc

    def _check_size(self, topic: str, key: str, value: bytes) -> None:
        spec = self._catalogue.spec_for_topic(topic)
        if spec is None:
            return
        size = record_bytes(key.encode(), value)
        if size > spec.max_message_bytes:
            raise ApiError(
                413,
                "too-large",
                f"the record would be about {size} bytes; the {spec.name} topic accepts at "
                f"most {spec.max_message_bytes}: make the payload smaller (for a function, "
                "move large data out of its closure and pass it as an argument)",
            )

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)


def _settle(future: Future[tuple[int, int]], error: KafkaError | None, message: Message) -> None:
    partition, offset = message.partition(), message.offset()
    if error is not None:
        future.set_exception(KafkaException(error))
    elif partition is None or offset is None:
        future.set_exception(KafkaException(KafkaError(KafkaError._FAIL, "no offset reported")))
    else:
        future.set_result((partition, offset))


def _check_readable(value: bytes, kind: type[Record]) -> None:
    # The view skips a record it cannot decode, so a write that passed the HTTP checks
    # but not the record schema would be "saved" yet never visible. Refuse it instead.
    try:
        decode(value, kind)
    except RecordDecodeError as exc:
        raise ApiError(422, "invalid-request", f"the record is not valid: {exc.reason}") from exc


def _kafka_unavailable(detail: str) -> ApiError:
    return ApiError(503, "kafka-unavailable", f"{detail}; check that the platform is up")


@dataclass(frozen=True)
class AccountSettings:
    """How the API authenticates and limits callers (docs/security.md, accounts)."""

    admin_token_sha256: str | None = None
    token_lifetime_s: float = DEFAULT_TOKEN_LIFETIME_S
    limits: RegistrationLimits = DEFAULT_LIMITS
    identity_providers: Mapping[str, IdentityProvider] | None = None


@dataclass
class Runtime:
    """What the handlers share: the catalogue, the view, the writer and an admin client."""

    catalogue: Catalogue
    view: RegistryView
    writer: RecordWriter
    admin: AdminClient
    timeout_s: float
    accounts: AccountSettings = field(default_factory=AccountSettings)
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter(DEFAULT_LIMITS))
    # Token changes read, modify and write a user record: one at a time in this process.
    account_lock: threading.Lock = field(default_factory=threading.Lock)
    # False on the insecure development platform: principals are then topics only.
    kafka_secure: bool = True
    # Pausing and resuming a rule read, modify and write it: one at a time in this process.
    trigger_lock: threading.Lock = field(default_factory=threading.Lock)
    # The analytics processor's windows (GET /v1/analytics).
    analytics: AnalyticsView | None = None
    # How the service reaches Kafka (an endpoint's logs are read on request).
    kafka: KafkaConnection | None = None
    # GET /metrics: the registry, and who may read it (admin, open, off).
    metrics: ApiMetrics | None = None
    metrics_access: str = "admin"

    def close(self) -> None:
        """Stop writing, then stop reading."""
        self.writer.close()
        self.view.close()
        if self.analytics is not None:
            self.analytics.close()
        if self.metrics is not None:
            self.metrics.close()


def _start_runtime(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    timeout_s: float,
    accounts: AccountSettings,
    metrics_access: str = "admin",
) -> Runtime:
    metrics = ApiMetrics() if metrics_access != "off" else None
    view = RegistryView(
        kafka,
        catalogue,
        component="api registry view",
        index_tasks=True,
        on_task_state=metrics.tasks.observe if metrics is not None else None,
    )
    try:
        view.start()
        if not view.wait_until_current(timeout_s=max(timeout_s, 30.0)):
            raise RuntimeError(
                "the registry topics could not be read to their end; check the broker's health"
            )
    except BaseException:
        view.close()
        raise
    dead_letters: DeadLetterCounter | None = None
    if metrics is not None:
        # Task states from now on (not every retained task again at each start).
        metrics.tasks.enable()
        dead_letters = DeadLetterCounter(kafka, catalogue, metrics.registry)
        try:
            dead_letters.start()
        except BaseException:
            dead_letters.close()
            view.close()
            raise
    analytics = AnalyticsView(kafka, catalogue)
    try:
        analytics.start()
    except BaseException:
        analytics.close()
        if dead_letters is not None:
            dead_letters.close()
        view.close()
        raise
    writer = RecordWriter(kafka, catalogue, view, timeout_s=timeout_s)
    writer.start()
    admin = AdminClient({**kafka.confluent(), "log_level": 2})
    if metrics is not None:
        metrics.attach(view, admin, dead_letters, timeout_s=min(timeout_s, 5.0))
    return Runtime(
        catalogue,
        view,
        writer,
        admin,
        timeout_s,
        accounts=accounts,
        limiter=RateLimiter(accounts.limits),
        kafka_secure=kafka.secure,
        analytics=analytics,
        kafka=kafka,
        metrics=metrics,
        metrics_access=metrics_access,
    )


def _accounts(runtime: Runtime) -> AccountManager:
    """Kafka principals (credential, ACLs, topics), made with the API's admin client."""
    return AccountManager(
        runtime.admin, runtime.catalogue, secure=runtime.kafka_secure, timeout_s=runtime.timeout_s
    )


def _kafka_principal(create: Callable[[str], KafkaPrincipal], principal_id: str) -> KafkaPrincipal:
    try:
        return create(principal_id)
    except AccountError as exc:
        raise _kafka_unavailable(str(exc)) from exc


def _kafka_answers(admin: AdminClient, timeout_s: float) -> bool:
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException:
        return False
    return True


# --- request context: the runtime and the caller -------------------------------------------

_bearer = HTTPBearer(
    auto_error=False,
    description="a user's token (from the platform admin, a rotation or a login), an "
    "endpoint's own token, or the platform admin's token",
)


def get_runtime(request: Request) -> Runtime:
    """The app's runtime (set by the lifespan)."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a user, an endpoint (its agent), or the platform admin."""

    kind: Literal["user", "endpoint", "admin"]
    user: UserRecord | None = None
    endpoint: EndpointRecord | None = None
    token_check: TokenCheck | None = None

    @property
    def key(self) -> str:
        """The caller's identity for rate limits."""
        if self.user is not None:
            return f"user:{self.user.user_id}"
        if self.endpoint is not None:
            return f"endpoint:{self.endpoint.endpoint_id}"
        return "admin"


_NEW_TOKEN_HELP = (
    "ask the platform admin for a new token (POST /v1/users/{user_id}/token with the admin "
    "token, which the platform keeps in <platform home>/credentials/api-admin.json)"
)


def _new_token_help(runtime: Runtime, user: UserRecord) -> str:
    remedy = _NEW_TOKEN_HELP.format(user_id=user.user_id)
    if user.external_identity is not None:
        provider = user.external_identity.partition(":")[0]
        if provider in (runtime.accounts.identity_providers or {}):
            remedy = f"log in again (POST /v1/login/{provider}), or {remedy}"
    return remedy


def get_principal(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Whoever's bearer token came with the request; 401 if none, unknown or no longer valid."""
    if credentials is None:
        raise _unauthorized(
            "send 'Authorization: Bearer <token>'; a user's token comes from the platform admin "
            "(fxstream user add) or from a login (POST /v1/login/<provider>)"
        )
    presented = token_sha256(credentials.credentials)
    if digest_matches(presented, runtime.accounts.admin_token_sha256):
        return Principal("admin")
    user = runtime.view.user_by_token_hash(presented)
    if user is not None:
        check = check_user_token(presented, user, lifetime_s=runtime.accounts.token_lifetime_s)
        if check.accepted:
            return Principal("user", user=user, token_check=check)
        raise _token_refused(check, user, _new_token_help(runtime, user))
    endpoint = runtime.view.endpoint_by_token_hash(presented)
    if endpoint is not None and endpoint_token_matches(presented, endpoint):
        return Principal("endpoint", endpoint=endpoint)
    raise _unauthorized(
        "the token is not known (it may have been replaced): a user gets a new token from "
        "the platform admin or a login (POST /v1/login/<provider>); an endpoint's owner gets "
        "a new endpoint token with POST /v1/endpoints/{endpoint_id}/token"
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_caller(principal: PrincipalDep) -> UserRecord:
    """The user whose token came with the request; 403 for an endpoint's or the admin's."""
    if principal.user is None:
        raise _wrong_principal(principal)
    return principal.user


CallerDep = Annotated[UserRecord, Depends(get_caller)]


def get_admin(principal: PrincipalDep) -> Principal:
    """The platform admin; 403 for any other token."""
    if principal.kind != "admin":
        raise ApiError(
            403,
            "admin-only",
            "only the platform admin creates users and issues their tokens: ask your "
            "platform's admin (fxstream user add), or log in through an identity provider "
            "(POST /v1/login/<provider>) if the service offers one",
        )
    return principal


AdminDep = Annotated[Principal, Depends(get_admin)]


def _wrong_principal(principal: Principal) -> ApiError:
    if principal.kind == "endpoint":
        detail = (
            "an endpoint's token may only fetch the code of functions of tasks routed to its "
            "endpoint (GET /v1/functions/{id}) and read its own endpoint: use a user's token"
        )
    else:
        detail = "the admin token only creates users and issues their tokens: use a user's token"
    return ApiError(403, "wrong-token-kind", detail)


def _unauthorized(detail: str, error: str = "unauthorized") -> ApiError:
    return ApiError(401, error, detail, headers={"WWW-Authenticate": "Bearer"})


def _token_refused(check: TokenCheck, user: UserRecord, remedy: str) -> ApiError:
    if check is TokenCheck.EXPIRED:
        return _unauthorized(f"the token of user {user.user_id} expired: {remedy}", "token-expired")
    if check is TokenCheck.REVOKED:
        return _unauthorized(
            f"the token of user {user.user_id} was revoked: {remedy}", "token-revoked"
        )
    return _unauthorized(
        f"this token of user {user.user_id} was replaced by a rotation and its grace is over: "
        f"use the token the rotation returned, or {remedy}",
        "token-rotated-away",
    )


def _limit(runtime: Runtime, kind: str, caller: str) -> None:
    """429 with Retry-After once ``caller`` used up its ``kind`` registrations."""
    wait_s = runtime.limiter.take(kind, caller)
    if wait_s is not None:
        raise ApiError(
            429,
            "rate-limited",
            f"too many {kind} registrations from this caller: retry after {wait_s:g} s "
            "(the platform admin sets the limits)",
            headers={"Retry-After": str(int(wait_s))},
        )


# --- rules and lookups ---------------------------------------------------------------------


def _new_id() -> str:
    return str(uuid.uuid4())


def _shared_with(user_ids: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(user_ids))  # drop repeats, keep the caller's order


def _may_use_function(user_id: str, function: FunctionRecord) -> bool:
    return may_use(
        user_id,
        owner_id=function.owner_id,
        public=function.public,
        allowed_users=function.allowed_users,
    )


def _may_use_endpoint(user_id: str, endpoint: EndpointRecord) -> bool:
    return may_use(
        user_id,
        owner_id=endpoint.owner_id,
        public=endpoint.public,
        allowed_users=endpoint.allowed_users,
    )


def _function_or_404(view: RegistryView, function_id: str, user_id: str) -> FunctionRecord:
    # Another user's private function answers exactly as one that does not exist.
    function = view.function(function_id)
    if function is None or not _may_use_function(user_id, function):
        raise ApiError(
            404,
            "not-found",
            f"function {function_id!r} does not exist or was deleted; "
            "GET /v1/functions lists the ones you may use",
        )
    return function


def _endpoint_or_404(view: RegistryView, endpoint_id: str, principal: Principal) -> EndpointRecord:
    # An endpoint the caller may not use answers exactly as one that does not exist; an
    # endpoint's token sees only its own endpoint.
    endpoint = view.endpoint(endpoint_id)
    if principal.endpoint is not None:
        visible = endpoint is not None and endpoint.endpoint_id == principal.endpoint.endpoint_id
    else:
        visible = (
            endpoint is not None
            and principal.user is not None
            and _may_use_endpoint(principal.user.user_id, endpoint)
        )
    if endpoint is None or not visible:
        raise ApiError(
            404,
            "not-found",
            f"endpoint {endpoint_id!r} does not exist or was deleted; "
            "GET /v1/endpoints lists the ones you may use",
        )
    return endpoint


def _require_owner(caller: UserRecord, owner_id: str, what: str, action: str = "delete it") -> None:
    # Only for an object the caller may see (shared with it): 404 was answered otherwise.
    if caller.user_id != owner_id:
        raise ApiError(403, "forbidden", f"only the owner of {what} may {action}")


def _routed_here(runtime: Runtime, endpoint_id: str, function_id: str) -> bool:
    """True when a task of ``function_id`` was routed to ``endpoint_id``.

    The router writes a task's "routed" state in the transaction of its dispatch, so
    when an agent asks for the code of a task it holds, that state is committed. But a
    read_committed reader sees it only once every transaction begun before it on its
    partition has ended too (the last stable offset), and another writer's open
    transaction may be holding it back. So on a miss: read task-state to its last
    stable offset as of now, look again, and repeat while some transaction is still
    open (last stable offset short of the high watermark), until ``timeout_s``. A
    caller with no such task gets its 404 once task-state has no open transaction
    left to wait for.
    """
    view = runtime.view
    if view.routed(endpoint_id, function_id):
        return True
    deadline = time.monotonic() + runtime.timeout_s
    while True:
        stable, high = _task_state_ends(runtime)
        view.wait_until_read(stable, max(0.0, deadline - time.monotonic()))
        if view.routed(endpoint_id, function_id):
            return True
        if stable == high or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _task_state_ends(
    runtime: Runtime,
) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
    """task-state's last stable offsets and high watermarks, per partition."""
    topic = runtime.catalogue.task_state
    try:
        described = runtime.admin.list_topics(topic, timeout=runtime.timeout_s).topics[topic]
        ends: list[dict[tuple[str, int], int]] = []
        for isolation in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED):
            asked = {
                KafkaTopicPartition(topic, partition): OffsetSpec.latest()  # type: ignore[no-untyped-call]
                for partition in described.partitions
            }
            answers = runtime.admin.list_offsets(
                asked, isolation_level=isolation, request_timeout=runtime.timeout_s
            )
            ends.append({(tp.topic, tp.partition): f.result().offset for tp, f in answers.items()})
    except (KafkaException, KeyError) as exc:
        raise _kafka_unavailable(f"cannot read the end offsets of {topic}: {exc}") from exc
    return ends[0], ends[1]


# --- records as JSON -----------------------------------------------------------------------


def _record_json(record: Record) -> dict[str, Any]:
    # msgspec writes bytes as standard base64, as the API promises.
    body: dict[str, Any] = msgspec.to_builtins(record)
    return body


def _function_summary(function: FunctionRecord) -> dict[str, Any]:
    body = _record_json(function)
    del body["code"]
    return body


def _endpoint_json(view: RegistryView, endpoint: EndpointRecord) -> dict[str, Any]:
    body = _record_json(endpoint)
    body["status"] = asdict(view.endpoint_status(endpoint.endpoint_id))
    return body


def _task_of_caller(view: RegistryView, caller: UserRecord, task_id: str) -> TaskState | None:
    # Another user's task reads as unknown in bulk queries: never reveal it exists.
    task = view.task(task_id)
    return task if task is not None and task.user_id == caller.user_id else None


# --- routes --------------------------------------------------------------------------------

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "no token, an unknown one, or one expired, revoked or rotated away",
        403: "the wrong kind of token for the route, or not the caller's to change",
        404: "unknown, deleted, or not visible to the caller",
        429: "too many registrations from this caller; see Retry-After",
        422: "the request is not valid; detail names the field",
        503: "Kafka did not answer in time",
    }.items()
}

router = APIRouter(prefix="/v1", responses=_ERRORS)


def _register_user(
    runtime: Runtime, name: str, external_identity: str | None = None
) -> tuple[UserRecord, str, KafkaPrincipal]:
    """Create a user: its Kafka principal and topics first, then its record and first token."""
    user_id, token = _new_id(), new_token()
    # The principal and topics first: a user that exists can always submit and get results.
    kafka = _kafka_principal(_accounts(runtime).create_user_principal, user_id)
    now = time.time()
    record = UserRecord(
        user_id=user_id,
        name=name,
        token_sha256=token_sha256(token),
        created_at=now,
        token_expires_at=now + runtime.accounts.token_lifetime_s,
        external_identity=external_identity,
    )
    runtime.writer.put(runtime.catalogue.users, user_id, record)
    return record, token, kafka


def _replace_token(runtime: Runtime, user: UserRecord, grace_s: float) -> NewToken:
    """Give ``user`` a new token; the current one works ``grace_s`` more seconds (0: none)."""
    token, now = new_token(), time.time()
    valid_until = now + grace_s if grace_s > 0 else None
    record = msgspec.structs.replace(
        user,
        token_sha256=token_sha256(token),
        token_expires_at=now + runtime.accounts.token_lifetime_s,
        token_revoked_at=None,
        # A revoked or expired token gets no grace: it stopped working already.
        previous_token_sha256=user.token_sha256 if valid_until is not None else None,
        previous_token_valid_until=valid_until,
    )
    runtime.writer.put(runtime.catalogue.users, user.user_id, record)
    return NewToken(
        user_id=user.user_id,
        token=token,
        token_expires_at=record.token_expires_at or 0.0,
        previous_token_valid_until=valid_until,
    )


@router.post("/users", status_code=201, tags=["users"])
def create_user(body: NewUser, admin: AdminDep, runtime: RuntimeDep) -> UserCreated:
    """Register a user and create its results topic (platform admin only; rate-limited).

    The token is shown only now; it expires after the service's token lifetime.
    """
    _limit(runtime, "users", admin.key)
    record, token, kafka = _register_user(runtime, body.name)
    return UserCreated(
        user_id=record.user_id,
        token=token,
        token_expires_at=record.token_expires_at or 0.0,
        kafka_username=kafka.username if kafka.password else None,
        kafka_password=kafka.password,
    )


@router.get("/users/me", tags=["users"])
def read_me(principal: PrincipalDep, runtime: RuntimeDep) -> Me:
    """The caller's id and name, and when the token used expires."""
    caller = get_caller(principal)
    expires = (
        caller.previous_token_valid_until
        if principal.token_check is TokenCheck.GRACE
        else token_expires_at(caller, runtime.accounts.token_lifetime_s)
    )
    return Me(user_id=caller.user_id, name=caller.name, token_expires_at=expires)


@router.post("/users/me/token", tags=["users"])
def rotate_token(
    principal: PrincipalDep, runtime: RuntimeDep, body: Rotation | None = None
) -> NewToken:
    """Replace the caller's token with a new one, shown only now.

    The old token stops at once (``grace_s`` 0, the default) or keeps working for
    ``grace_s`` seconds (at most a day): ``previous_token_valid_until`` says which.
    Only the current token may rotate, not one already rotated away.
    """
    caller = get_caller(principal)
    if principal.token_check is TokenCheck.GRACE:
        raise _unauthorized(
            "this token was already rotated away: rotate with the token the rotation returned",
            "token-rotated-away",
        )
    grace_s = 0.0 if body is None else body.grace_s
    with runtime.account_lock:
        current = runtime.view.user(caller.user_id) or caller
        return _replace_token(runtime, current, grace_s)


@router.delete("/users/me/token", status_code=204, tags=["users"])
def revoke_token(caller: CallerDep, runtime: RuntimeDep) -> Response:
    """Revoke the caller's token (and a rotated-away one still in its grace) at once.

    The user then needs a new token from the platform admin (or a login).
    """
    with runtime.account_lock:
        current = runtime.view.user(caller.user_id) or caller
        record = msgspec.structs.replace(
            current,
            token_revoked_at=time.time(),
            previous_token_valid_until=None,
        )
        runtime.writer.put(runtime.catalogue.users, caller.user_id, record)
    return Response(status_code=204)


@router.post("/users/{user_id}/token", tags=["users"])
def issue_token(user_id: str, _: AdminDep, runtime: RuntimeDep) -> NewToken:
    """Issue a user a new token (platform admin only): every earlier token stops at once.

    Declared after ``/users/me/token`` so that ``me`` is never taken for a user id.

    The remedy for an expired, revoked or lost token.
    """
    with runtime.account_lock:
        user = runtime.view.user(user_id)
        if user is None:
            raise ApiError(404, "not-found", f"user {user_id!r} does not exist")
        return _replace_token(runtime, user, grace_s=0.0)


@router.post("/login/{provider}", tags=["users"])
def login(provider: str, body: Login, request: Request, runtime: RuntimeDep) -> LoggedIn:
    """Exchange an identity provider's token (e.g. Globus Auth) for an fxstream token.

    The first login of an identity creates its user; every login issues a new
    token and stops the previous one at once. Rate-limited per client address.
    """
    providers = runtime.accounts.identity_providers or {}
    adapter = providers.get(provider)
    if adapter is None:
        offered = ", ".join(sorted(providers)) or "none"
        raise ApiError(
            404,
            "not-found",
            f"this service has no identity provider {provider!r} (it offers: {offered}); "
            "ask the platform admin for a user instead",
        )
    _limit(runtime, "logins", f"address:{request.client.host if request.client else '?'}")
    try:
        identity = adapter.identify(body.token)
    except IdentityRejected as exc:
        raise _unauthorized(str(exc), "identity-rejected") from exc
    except IdentityProviderUnavailable as exc:
        raise ApiError(503, "identity-provider-unavailable", str(exc)) from exc
    with runtime.account_lock:
        user = runtime.view.user_by_external_identity(identity.key)
        if user is None:
            _limit(runtime, "users", f"provider:{provider}")
            record, token, kafka = _register_user(runtime, identity.name, identity.key)
            return LoggedIn(
                user_id=record.user_id,
                token=token,
                token_expires_at=record.token_expires_at or 0.0,
                created=True,
                kafka_username=kafka.username if kafka.password else None,
                kafka_password=kafka.password,
            )
        issued = _replace_token(runtime, user, grace_s=0.0)
    return LoggedIn(**issued.model_dump(), created=False)


@router.post("/functions", status_code=201, tags=["functions"])
def create_function(body: NewFunction, caller: CallerDep, runtime: RuntimeDep) -> FunctionCreated:
    """Register a function owned by the caller (rate-limited per user)."""
    _limit(runtime, "functions", f"user:{caller.user_id}")
    record = FunctionRecord(
        function_id=_new_id(),
        name=body.name,
        owner_id=caller.user_id,
        code=body.code,
        code_sha256=code_sha256(body.code),
        created_at=time.time(),
        container=body.container,
        public=body.public,
        allowed_users=_shared_with(body.allowed_users),
        description=body.description,
        metadata=dict(body.metadata),
    )
    runtime.writer.put(runtime.catalogue.functions, record.function_id, record)
    return FunctionCreated(function_id=record.function_id, code_sha256=record.code_sha256)


@router.get("/functions", tags=["functions"])
def list_functions(caller: CallerDep, runtime: RuntimeDep) -> list[dict[str, Any]]:
    """The caller's own functions, the public ones and those shared with the caller."""
    visible = [f for f in runtime.view.functions() if _may_use_function(caller.user_id, f)]
    return [_function_summary(f) for f in sorted(visible, key=lambda f: f.created_at)]


@router.get("/functions/{function_id}", tags=["functions"])
def read_function(function_id: str, principal: PrincipalDep, runtime: RuntimeDep) -> dict[str, Any]:
    """A function with its code.

    A user sees its own, public and shared functions. An endpoint's token sees a
    function only once a task of it was routed to that endpoint (the agent fetching
    the code of a task it holds). Anything else is 404, as if it did not exist.
    """
    if principal.endpoint is not None:
        function = runtime.view.function(function_id)
        if function is not None and _routed_here(
            runtime, principal.endpoint.endpoint_id, function_id
        ):
            return _record_json(function)
        raise ApiError(
            404,
            "not-found",
            f"function {function_id!r} does not exist, or no task of it was routed to "
            f"endpoint {principal.endpoint.endpoint_id}",
        )
    caller = get_caller(principal)
    return _record_json(_function_or_404(runtime.view, function_id, caller.user_id))


@router.delete("/functions/{function_id}", status_code=204, tags=["functions"])
def delete_function(function_id: str, caller: CallerDep, runtime: RuntimeDep) -> Response:
    """Delete one of the caller's functions (a tombstone on the functions topic)."""
    function = _function_or_404(runtime.view, function_id, caller.user_id)
    _require_owner(caller, function.owner_id, f"function {function_id!r}")
    runtime.writer.delete(runtime.catalogue.functions, function_id)
    return Response(status_code=204)


@router.post("/endpoints", status_code=201, tags=["endpoints"])
def create_endpoint(body: NewEndpoint, caller: CallerDep, runtime: RuntimeDep) -> EndpointCreated:
    """Register an endpoint owned by the caller: its Kafka principal (for its agents, never
    the owner's) and topics, then its record (rate-limited per user).

    The answer carries the endpoint's own API token and Kafka password, shown only now.
    """
    _limit(runtime, "endpoints", f"user:{caller.user_id}")
    endpoint_id, token = _new_id(), new_token()
    # The queue first: an endpoint the router can see always has a queue to route to.
    kafka = _kafka_principal(_accounts(runtime).create_endpoint_principal, endpoint_id)
    record = EndpointRecord(
        endpoint_id=endpoint_id,
        name=body.name,
        owner_id=caller.user_id,
        created_at=time.time(),
        public=body.public,
        allowed_users=_shared_with(body.allowed_users),
        description=body.description,
        metadata=body.metadata,
        token_sha256=token_sha256(token),
    )
    runtime.writer.put(runtime.catalogue.endpoints, endpoint_id, record)
    return EndpointCreated(
        endpoint_id=endpoint_id,
        token=token,
        kafka_username=kafka.username if kafka.password else None,
        kafka_password=kafka.password,
    )


@router.post("/endpoints/{endpoint_id}/token", tags=["endpoints"])
def replace_endpoint_token(
    endpoint_id: str, caller: CallerDep, runtime: RuntimeDep
) -> EndpointToken:
    """Give one of the caller's endpoints a new token; the old one stops at once."""
    endpoint = _endpoint_or_404(runtime.view, endpoint_id, Principal("user", user=caller))
    _require_owner(caller, endpoint.owner_id, f"endpoint {endpoint_id!r}", "replace its token")
    token = new_token()
    with runtime.account_lock:
        current = runtime.view.endpoint(endpoint_id) or endpoint
        record = msgspec.structs.replace(current, token_sha256=token_sha256(token))
        runtime.writer.put(runtime.catalogue.endpoints, endpoint_id, record)
    return EndpointToken(endpoint_id=endpoint_id, token=token)


@router.get("/endpoints", tags=["endpoints"])
def list_endpoints(principal: PrincipalDep, runtime: RuntimeDep) -> list[dict[str, Any]]:
    """The endpoints the caller may use, each with its status (an endpoint's token: itself)."""
    if principal.endpoint is not None:
        own = runtime.view.endpoint(principal.endpoint.endpoint_id)
        return [] if own is None else [_endpoint_json(runtime.view, own)]
    caller = get_caller(principal)
    visible = [e for e in runtime.view.endpoints() if _may_use_endpoint(caller.user_id, e)]
    return [_endpoint_json(runtime.view, e) for e in sorted(visible, key=lambda e: e.created_at)]


@router.get("/endpoints/{endpoint_id}", tags=["endpoints"])
def read_endpoint(endpoint_id: str, principal: PrincipalDep, runtime: RuntimeDep) -> dict[str, Any]:
    """One endpoint and its status (online, lost or never-seen)."""
    if principal.kind == "admin":
        raise _wrong_principal(principal)
    endpoint = _endpoint_or_404(runtime.view, endpoint_id, principal)
    return _endpoint_json(runtime.view, endpoint)


@router.get("/endpoints/{endpoint_id}/logs", tags=["endpoints"])
def read_endpoint_logs_route(
    endpoint_id: str,
    caller: CallerDep,
    runtime: RuntimeDep,
    limit: Annotated[int, Query(ge=1, le=5_000)] = 200,
    level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        Query(description="the lowest level shown"),
    ] = "INFO",
    since: Annotated[float | None, Query(description="lines after this time (epoch s)")] = None,
) -> dict[str, Any]:
    """The newest ``limit`` lines its agents logged, for the endpoint's owner only (a user
    it is shared with: 403; anyone else: 404), oldest first
    (:mod:`fxstream.service.endpoint_logs`)."""
    endpoint = _endpoint_or_404(runtime.view, endpoint_id, Principal(kind="user", user=caller))
    _require_owner(caller, endpoint.owner_id, f"endpoint {endpoint_id!r}", "read its logs")
    if runtime.kafka is None:
        raise ApiError(503, "unavailable", "this service was started without Kafka")
    try:
        return read_endpoint_logs(
            runtime.kafka,
            runtime.catalogue.endpoint_logs,
            endpoint_id,
            limit=limit,
            level=level,
            since=since,
            timeout_s=runtime.timeout_s,
        )
    except KafkaException as exc:
        raise _kafka_unavailable(f"cannot read the endpoint's logs: {exc}") from exc


@router.delete("/endpoints/{endpoint_id}", status_code=204, tags=["endpoints"])
def delete_endpoint(endpoint_id: str, caller: CallerDep, runtime: RuntimeDep) -> Response:
    """Delete one of the caller's endpoints: its record, then its Kafka principal (no agent
    of it logs in again), its ACLs and its topics (tasks still queued go with them)."""
    endpoint = _endpoint_or_404(runtime.view, endpoint_id, Principal("user", user=caller))
    _require_owner(caller, endpoint.owner_id, f"endpoint {endpoint_id!r}")
    runtime.writer.delete(runtime.catalogue.endpoints, endpoint_id)
    try:
        _accounts(runtime).delete_endpoint_principal(endpoint_id)
    except AccountError as exc:
        raise _kafka_unavailable(f"{exc} (the endpoint's record is already deleted)") from exc
    return Response(status_code=204)


def _retention_text() -> str:
    """How long task-state keeps a finished task, in words (the processors' setting, from
    the same environment)."""
    try:
        seconds = retention_from_env()
    except ValueError:
        seconds = DEFAULT_RETENTION_S  # the processors refuse to start with it anyway
    if seconds >= 2 * 86_400:
        return f"{seconds / 86_400:g} days"
    if seconds >= 2 * 3_600:
        return f"{seconds / 3_600:g} hours"
    return f"{seconds:g} s"


@router.get("/tasks/{task_id}", tags=["tasks"])
def read_task(task_id: str, caller: CallerDep, runtime: RuntimeDep) -> dict[str, Any]:
    """The latest state of one of the caller's tasks, with its ``events``: the site
    timestamps it holds as an ordered log of ``{state, at, where, attempt}``."""
    task = _task_of_caller(runtime.view, caller, task_id)
    if task is None:
        # Another user's task answers exactly as an unknown one.
        raise ApiError(
            404,
            "not-found",
            f"no state for task {task_id!r}: a task appears once the processors have "
            "seen its submission, and a finished one is kept for "
            f"{_retention_text()} after it finished",
        )
    return _task_json(task)


@router.get("/tasks", tags=["tasks"])
def query_tasks(
    caller: CallerDep,
    runtime: RuntimeDep,
    tag: Annotated[
        list[str] | None,
        Query(
            max_length=MAX_QUERY_TAGS,
            description="key:value; repeat for several (a task must carry every one)",
        ),
    ] = None,
    state: Annotated[
        list[TaskStateName] | None, Query(description="repeat for any of several states")
    ] = None,
    function_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    endpoint_id: Annotated[
        str | None, Query(pattern=ID_PATTERN, description="where it was routed (ran)")
    ] = None,
    group: Annotated[str | None, Query(pattern=ID_PATTERN, description="task group id")] = None,
    since: Annotated[
        float | None,
        Query(ge=0, le=LATEST_TIMESTAMP, description="submitted at or after (epoch seconds)"),
    ] = None,
    until: Annotated[
        float | None,
        Query(ge=0, le=LATEST_TIMESTAMP, description="submitted at or before (epoch seconds)"),
    ] = None,
    order: Annotated[
        Literal["asc", "desc"], Query(description="by submission time; desc: newest first")
    ] = "asc",
    limit: Annotated[
        int, Query(ge=1, le=MAX_TASK_PAGE, description="the most tasks to return")
    ] = DEFAULT_TASK_PAGE,
    cursor: Annotated[
        str | None, Query(description="next_cursor of the previous page (same filters)")
    ] = None,
) -> TaskPage:
    """The caller's tasks that match every filter given, by submission time, paged.

    Only the caller's own tasks are ever walked. Every task task-state holds is
    queryable (the topic is compacted and kept forever), from the moment the API's view
    has read its first state. A page ends at ``limit`` tasks, about 8 MiB of values, or
    10,000 index entries read, whichever comes first: follow ``next_cursor`` until it is
    null.
    """
    try:
        tags = dict(parse_tag(text) for text in tag or ())
        after = decode_cursor(cursor) if cursor is not None else None
    except ValueError as exc:
        raise ApiError(422, "invalid-request", str(exc)) from None
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and not math.isfinite(moment):
            raise ApiError(
                422, "invalid-request", f"{name} must be seconds since the epoch, not {moment}"
            )
    if since is not None and until is not None and until < since:
        raise ApiError(
            422, "invalid-request", f"until ({until}) is before since ({since}): swap them"
        )
    query = TaskQuery(
        user_id=caller.user_id,
        tags=tags or None,
        states=frozenset(str(name) for name in state) if state else None,
        function_id=function_id,
        endpoint_id=endpoint_id,
        task_group_id=group,
        since=since,
        until=until,
        descending=order == "desc",
    )
    found = runtime.view.query_tasks(query, limit=limit, after=after, max_scan=DEFAULT_MAX_SCAN)
    tasks: list[dict[str, Any]] = []
    value_bytes = 0
    next_position = found.cursor
    previous: bytes | None = None
    for task_id, position in found.matches:
        task = _task_of_caller(runtime.view, caller, task_id)
        if task is None:
            continue
        size = len(task.value or b"")
        if tasks and value_bytes + size > MAX_GROUP_PAGE_VALUE_BYTES:
            next_position = previous
            break
        value_bytes += size
        tasks.append(_task_json(task))
        previous = position
    return TaskPage(
        tasks=tasks,
        next_cursor=None if next_position is None else encode_cursor(next_position),
        scanned=found.scanned,
    )


@router.post("/tasks/status", tags=["tasks"])
def read_task_states(
    body: TaskIds, caller: CallerDep, runtime: RuntimeDep
) -> dict[str, dict[str, Any] | None]:
    """The states of many of the caller's tasks; unknown (or not the caller's) is null."""
    states = {task_id: _task_of_caller(runtime.view, caller, task_id) for task_id in body.task_ids}
    return {
        task_id: None if state is None else _task_json(state) for task_id, state in states.items()
    }


def _task_json(task: TaskState) -> dict[str, Any]:
    """A task state as the task routes answer it: the record and its event log."""
    body = _record_json(task)
    body["events"] = event_log(task)
    return body


@router.get("/task-groups/{task_group_id}/tasks", tags=["tasks"])
def read_task_group(
    task_group_id: Annotated[str, Path(pattern=ID_PATTERN, description="the task group id")],
    caller: CallerDep,
    runtime: RuntimeDep,
    offset: Annotated[int, Query(ge=0, description="the first task to return")] = 0,
    limit: Annotated[
        int, Query(ge=1, le=MAX_GROUP_PAGE, description="the most tasks to return")
    ] = MAX_GROUP_PAGE,
) -> TaskGroupPage:
    """The caller's tasks of a task group with their states, in the order first seen.

    Paged: follow ``next_offset`` until it is null. A page also ends early once
    its values pass 8 MiB. Tasks appear once the router has seen them.
    """
    task_ids = runtime.view.task_group(task_group_id, caller.user_id)
    if not task_ids:
        # A group holding only another user's tasks answers exactly as an unknown one.
        raise ApiError(
            404,
            "not-found",
            f"no task of task group {task_group_id!r} is known (yet): a task appears once "
            "the router has seen its submission; check the id (Executor.task_group_id)",
        )
    tasks: list[dict[str, Any]] = []
    value_bytes = 0
    position = offset
    while position < len(task_ids) and len(tasks) < limit:
        state = runtime.view.task(task_ids[position])
        if state is not None:
            size = len(state.value or b"")
            if tasks and value_bytes + size > MAX_GROUP_PAGE_VALUE_BYTES:
                break
            value_bytes += size
            tasks.append(_record_json(state))
        position += 1
    return TaskGroupPage(
        task_group_id=task_group_id,
        total=len(task_ids),
        offset=offset,
        next_offset=position if position < len(task_ids) else None,
        tasks=tasks,
    )


# --- trigger rules -------------------------------------------------------------------------


def _trigger_or_404(view: RegistryView, rule_id: str, caller: UserRecord) -> TriggerRule:
    # Another user's rule answers exactly as one that does not exist.
    rule = view.trigger(rule_id)
    if rule is None or rule.owner_id != caller.user_id:
        raise ApiError(
            404,
            "not-found",
            f"trigger rule {rule_id!r} does not exist or was deleted; GET /v1/triggers lists yours",
        )
    return rule


def _trigger_record(fields: dict[str, Any]) -> TriggerRule:
    try:
        return msgspec.convert({"kind": "trigger-rule", **fields}, TriggerRule)
    except msgspec.ValidationError as exc:
        raise ApiError(
            422, "invalid-request", f"the rule is not valid: {exc}; {_TRIGGER_HELP}"
        ) from exc


@router.post("/triggers", status_code=201, tags=["triggers"])
def create_trigger(body: NewTrigger, caller: CallerDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Register a trigger rule owned by the caller (rate-limited per user).

    The caller must be allowed to use the function and every endpoint now (404 as for
    any function or endpoint they may not see); each firing is authorised again by the
    router, as the caller's own submission. The rule pins the function's current code
    digest: a firing after the function changed is refused (FunctionChanged).
    """
    _limit(runtime, "triggers", f"user:{caller.user_id}")
    function = _function_or_404(runtime.view, body.function_id, caller.user_id)
    principal = Principal("user", user=caller)
    for endpoint_id in dict.fromkeys([body.endpoint_id, *(body.endpoint_group or [])]):
        _endpoint_or_404(runtime.view, endpoint_id, principal)
    now = time.time()
    fields = body.model_dump(exclude={"max_in_flight", "max_per_second"})
    rule = _trigger_record(
        {
            **fields,
            "rule_id": _new_id(),
            "owner_id": caller.user_id,
            "function_sha256": function.code_sha256,
            "limits": {
                "max_in_flight": body.max_in_flight,
                "max_per_second": body.max_per_second,
            },
            "created_at": now,
            "updated_at": now,
        }
    )
    runtime.writer.put(runtime.catalogue.triggers, rule.rule_id, rule)
    return _record_json(rule)


@router.get("/triggers", tags=["triggers"])
def list_triggers(caller: CallerDep, runtime: RuntimeDep) -> list[dict[str, Any]]:
    """The caller's trigger rules, oldest first."""
    own = [r for r in runtime.view.triggers() if r.owner_id == caller.user_id]
    return [_record_json(r) for r in sorted(own, key=lambda r: r.created_at)]


@router.get("/triggers/{rule_id}", tags=["triggers"])
def read_trigger(rule_id: str, caller: CallerDep, runtime: RuntimeDep) -> dict[str, Any]:
    """One of the caller's rules with its ``status``.

    ``fired``: the rule's tasks the service has seen (its task group, id = the rule
    id); ``in_flight``: those not yet succeeded, failed, rejected or cancelled;
    ``states``: the count per state; ``waiting``: the events on the rule's source the
    trigger processor has not gone past yet (its consumer group's lag; null when the
    source's topic does not exist), including those held at a rule's limit.
    """
    rule = _trigger_or_404(runtime.view, rule_id, caller)
    states: dict[str, int] = {}
    task_ids = runtime.view.task_group(rule.rule_id, rule.owner_id)
    for task_id in task_ids:
        state = runtime.view.task(task_id)
        if state is not None:
            states[str(state.state)] = states.get(str(state.state), 0) + 1
    body = _record_json(rule)
    body["status"] = {
        "fired": len(task_ids),
        "in_flight": sum(n for name, n in states.items() if name not in _TERMINAL_STATES),
        "states": states,
        "waiting": _source_lag(runtime, runtime.catalogue.events(rule.source)),
    }
    return body


def _set_paused(runtime: Runtime, rule_id: str, caller: UserRecord, paused: bool) -> TriggerRule:
    with runtime.trigger_lock:
        rule = _trigger_or_404(runtime.view, rule_id, caller)
        if rule.paused != paused:
            rule = msgspec.structs.replace(rule, paused=paused, updated_at=time.time())
            runtime.writer.put(runtime.catalogue.triggers, rule_id, rule)
    return rule


@router.post("/triggers/{rule_id}/pause", tags=["triggers"])
def pause_trigger(rule_id: str, caller: CallerDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Pause one of the caller's rules: events processed while it is paused fire nothing
    (not later either)."""
    return _record_json(_set_paused(runtime, rule_id, caller, True))


@router.post("/triggers/{rule_id}/resume", tags=["triggers"])
def resume_trigger(rule_id: str, caller: CallerDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Resume one of the caller's rules: it fires again for the events processed from now."""
    return _record_json(_set_paused(runtime, rule_id, caller, False))


@router.delete("/triggers/{rule_id}", status_code=204, tags=["triggers"])
def delete_trigger(rule_id: str, caller: CallerDep, runtime: RuntimeDep) -> Response:
    """Delete one of the caller's rules (a tombstone on the triggers topic); its tasks stay."""
    with runtime.trigger_lock:
        _trigger_or_404(runtime.view, rule_id, caller)
        runtime.writer.delete(runtime.catalogue.triggers, rule_id)
    return Response(status_code=204)


def _metrics(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Response:
    """Prometheus metrics of the platform (docs/metrics.md): counts and durations only.

    Outside ``/v1``: a scraper's path. By default only the platform admin's token reads
    it (per-endpoint series name endpoint ids, which the API otherwise shows only to
    those who may use them); ``FXSTREAM_API_METRICS=open`` serves it to anyone who
    reaches the port, ``off`` answers 404.
    """
    if runtime.metrics is None or runtime.metrics_access == "off":
        raise ApiError(404, "not-found", "metrics are off here (FXSTREAM_API_METRICS=off)")
    if runtime.metrics_access == "admin":
        presented = None if credentials is None else token_sha256(credentials.credentials)
        if presented is None or not digest_matches(presented, runtime.accounts.admin_token_sha256):
            raise _unauthorized(
                "GET /metrics needs the platform admin's token ('Authorization: Bearer "
                "<token>', from <platform home>/credentials/api-admin.json), or the API "
                "started with FXSTREAM_API_METRICS=open"
            )
    return Response(
        content=generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def _source_lag(runtime: Runtime, topic: str) -> int | None:
    """How many records of ``topic`` the trigger processor's group has not gone past."""
    try:
        described = runtime.admin.list_topics(topic, timeout=runtime.timeout_s).topics.get(topic)
        if described is None or described.error is not None:
            return None
        partitions = [KafkaTopicPartition(topic, p) for p in described.partitions]
        asked = runtime.admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(TRIGGER_GROUP, partitions)],
            request_timeout=runtime.timeout_s,
        )
        committed = {
            tp.partition: tp.offset for tp in asked[TRIGGER_GROUP].result().topic_partitions or []
        }
        ends: list[dict[int, int]] = []
        for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):  # type: ignore[no-untyped-call]
            answers = runtime.admin.list_offsets(
                {tp: spec for tp in partitions},
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=runtime.timeout_s,
            )
            ends.append({tp.partition: f.result().offset for tp, f in answers.items()})
    except KafkaException as exc:
        raise _kafka_unavailable(
            f"cannot read the trigger processor's lag on {topic}: {exc}"
        ) from exc
    earliest, latest = ends
    lag = 0
    for partition, end in latest.items():
        position = committed.get(partition, -1)
        start = position if position >= 0 else earliest.get(partition, 0)
        lag += max(0, end - max(start, earliest.get(partition, 0)))
    return lag


MAX_ANALYTICS_PAGE = 1000
AGGREGATE_KEY_PATTERN = r"^(?:[A-Za-z0-9][A-Za-z0-9-]{0,127}|~other)$"


@router.get("/analytics", tags=["analytics"])
def read_analytics(
    principal: PrincipalDep,
    runtime: RuntimeDep,
    dimension: Annotated[
        Literal["user", "function", "endpoint", "rule"],
        Query(
            description="what the windows are per: the user, or the user's functions, "
            "endpoints or trigger rules"
        ),
    ] = "user",
    key: Annotated[
        str | None,
        Query(
            pattern=AGGREGATE_KEY_PATTERN,
            description="one user, function, endpoint or rule id ('~other': the ids past "
            "the processor's bound); all of them by default",
        ),
    ] = None,
    window: Annotated[
        Literal["tumbling", "hopping"] | None, Query(description="one window family")
    ] = None,
    user_id: Annotated[
        str | None,
        Query(
            pattern=ID_PATTERN,
            description="the admin: one user's windows (default: every user's, summed)",
        ),
    ] = None,
    since: Annotated[
        float | None,
        Query(ge=0, le=LATEST_TIMESTAMP, description="windows ending after (epoch seconds)"),
    ] = None,
    until: Annotated[
        float | None,
        Query(ge=0, le=LATEST_TIMESTAMP, description="windows starting at or before"),
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=MAX_ANALYTICS_PAGE, description="the newest windows to return")
    ] = 100,
) -> dict[str, Any]:
    """Windowed aggregates of task states (the analytics processor's ``analytics`` topic),
    oldest first: per window, the finished tasks and their outcomes, errors and the error
    rate, finished tasks per second, state changes by state, and latency (submission to
    result) percentiles from a bounded histogram.

    A user sees the windows of its own tasks only (``user_id`` naming another user finds
    nothing); the platform admin sees every user's, summed per window and key unless
    ``user_id`` names one. An endpoint's token is refused.
    """
    if principal.kind == "endpoint":
        raise _wrong_principal(principal)
    if runtime.analytics is None:
        raise ApiError(503, "unavailable", "the API was started without its analytics view")
    combine = False
    owner = user_id
    if principal.user is not None:
        if user_id not in (None, principal.user.user_id):
            return {"windows": [], "truncated": False}
        owner = principal.user.user_id
    else:
        combine = user_id is None
    found = runtime.analytics.query(
        user_id=owner,
        window=window,
        dimension=dimension,
        key=key,
        since=since,
        until=until,
        combine_users=combine,
    )
    truncated = len(found) > limit
    windows = [summarize(aggregate) for aggregate in found[-limit:]]
    if combine:
        for item in windows:
            item["user_id"] = None
    return {"windows": windows, "truncated": truncated}


@router.get("/version", tags=["health"])
def version() -> Version:
    """The service's fxstream version (no token needed). The SDK, the endpoint agent and the
    service ship together from one workspace, so the oldest versions it works with are its
    own (``Client.version_check``)."""
    own = client_info().fxstream_version
    return Version(version=own, min_sdk_version=own, min_ep_version=own)


@router.get("/health", tags=["health"])
def health(runtime: RuntimeDep) -> Health:
    """Whether the service answers (always) and whether Kafka does (no token needed)."""
    return Health(kafka=_kafka_answers(runtime.admin, timeout_s=min(runtime.timeout_s, 3.0)))


# --- errors: one body shape for every 4xx and 5xx ------------------------------------------


def _error(
    status: int, error: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def _field_name(location: Sequence[int | str]) -> str:
    # ("body", "allowed_users", 0) -> "allowed_users[0]"; a whole-body error is "body".
    parts = list(location[1:]) if location and location[0] == "body" else list(location)
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def _problem(error: Mapping[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return f"body: is not valid JSON ({reason})" if reason else "body: is not valid JSON"
    message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
    return f"{_field_name(error.get('loc', ()))}: {message}"


def _validation_detail(exc: RequestValidationError) -> str:
    problems = "; ".join(_problem(error) for error in exc.errors())
    return f"{problems} (see /docs for the request schema)"


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _error(exc.status, exc.error, exc.detail, exc.headers)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _error(422, "invalid-request", _validation_detail(exc))


_HTTP_ERROR_CODES = {404: "not-found", 405: "method-not-allowed", 413: "body-too-large"}


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path}; see /docs for the API"
    elif exc.status_code == 405:
        detail = f"{request.method} is not allowed on {request.url.path}; see /docs"
    else:
        detail = str(exc.detail)
    code = _HTTP_ERROR_CODES.get(exc.status_code, "http-error")
    return _error(exc.status_code, code, detail, dict(exc.headers or {}) or None)


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return _error(
        500, "internal", f"the service failed ({type(exc).__name__}); its log has the details"
    )


# --- the app -------------------------------------------------------------------------------


def create_app(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    *,
    timeout_s: float = 15.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    accounts: AccountSettings | None = None,
    metrics: str = "admin",
) -> FastAPI:
    """The REST API on the registry topics of ``catalogue``, connecting to Kafka as ``kafka``.

    Starting it (its lifespan) reads the registry topics to their end before it
    serves; ``timeout_s`` bounds each wait for Kafka inside a request. A request
    body above ``max_body_bytes`` is refused with 413 before it is read
    (:mod:`fxstream.service.body_limit`). ``accounts`` holds the admin token's
    hash (without one, no user can be created but through an identity provider),
    the token lifetime, the registration limits and the identity providers.
    ``metrics`` says who may read ``GET /metrics`` (:func:`_metrics`): ``admin`` (the
    platform admin's token), ``open`` (anyone who reaches the port) or ``off``.
    """
    settings = AccountSettings() if accounts is None else accounts
    access = metrics_access(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await asyncio.to_thread(
            _start_runtime, kafka, catalogue, timeout_s, settings, access
        )
        app.state.runtime = runtime
        # Where its memory is, every few minutes (and the allocator's free heap returned).
        interval = report_interval_s()
        reporter = None
        if interval > 0:
            report = MemoryReport()
            report.add_table("view", runtime.view.memory_figures)
            reporter = asyncio.create_task(report_periodically(report, interval))
        try:
            yield
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            await asyncio.to_thread(runtime.close)

    app = FastAPI(
        title="fxstream",
        summary="Registry (users, functions, endpoints) and task status of fxstream",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.include_router(router)
    app.add_api_route(
        "/metrics",
        _metrics,
        methods=["GET"],
        include_in_schema=False,
        response_class=Response,
    )
    app.include_router(dashboard_router())  # the page at /dashboard (docs/dashboard.md)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
    return app
