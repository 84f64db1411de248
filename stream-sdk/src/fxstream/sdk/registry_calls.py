"""The registry calls of a :class:`~fxstream.sdk.Client`: functions, endpoints (their
status, logs and metadata), trigger rules, analytics, and the service's version.

:class:`RegistryCalls` holds them; the :class:`~fxstream.sdk.Client` facade inherits
them, so ``client.register_function(...)`` is as it was. Each is one REST call to the
service (docs/api.md), named as in Globus Compute where Globus Compute has the call
(docs/globus-compute.md).
"""

from __future__ import annotations

import base64
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlencode

from fxstream.sdk.hardware import hardware_report
from fxstream.sdk.rest import RestClient
from fxstream.sdk.versions import check_versions, registration_metadata
from fxstream.topics import Serializer, client_info

__all__ = ["Predicate", "RegistryCalls"]

# Code digests remembered per client (function id -> SHA-256 of its registered code).
_DIGESTS_KEPT: Final = 10_000
# A docstring taken as a function's description is cut to the service's limit for it.
_DOCSTRING_CHARS: Final = 65_536

Predicate = Mapping[str, Any] | tuple[str, str] | tuple[str, str, Any]
"""What a trigger rule's predicate may be given as: a mapping, or (attribute, op[, value])."""


class RegistryCalls:
    """Functions, endpoints, trigger rules, analytics and versions (see the module notes)."""

    # Set by the Client facade (fxstream.sdk.client).
    serializer: Serializer
    _rest: RestClient
    _lock: threading.Lock
    _digests: dict[str, str]
    _token: str | None

    if TYPE_CHECKING:

        @property
        def user_id(self) -> str:
            """The caller's user id (the facade's)."""
            ...

        def _require_token(self) -> str: ...

        def run(self, *args: Any, endpoint_id: str, function_id: str, **kwargs: Any) -> str: ...

    # --- functions ---------------------------------------------------------------------

    def register_function(
        self,
        fn: Callable[..., Any],
        description: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        public: bool = False,
        group: str | None = None,
        ha_endpoint_id: str | None = None,
        *,
        name: str | None = None,
        container: str | None = None,
        allowed_users: Iterable[str] = (),
    ) -> str:
        """Register ``fn`` (serialized by value with the code strategy); returns its function id.

        Globus Compute's parameters, in its order: ``description`` (default: ``fn``'s
        docstring), ``metadata`` (labels kept with the function, values as strings; the
        SDK adds ``python_version`` and ``sdk_version`` unless given), ``public`` (anyone
        may run it). ``group`` (a Globus group to share with) and ``ha_endpoint_id`` have
        no counterpart here and are refused with ``ValueError`` saying what to use:
        ``allowed_users`` shares it with those user ids. ``name`` defaults to the
        function's ``__name__``.
        """
        return self.register_serialized_function(
            fn,
            self.serializer.serialize_function(fn),
            description,
            metadata,
            public,
            group,
            ha_endpoint_id,
            name=name,
            container=container,
            allowed_users=allowed_users,
        )

    def register_serialized_function(
        self,
        fn: Callable[..., Any],
        code: bytes,
        description: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        public: bool = False,
        group: str | None = None,
        ha_endpoint_id: str | None = None,
        *,
        name: str | None = None,
        container: str | None = None,
        allowed_users: Iterable[str] = (),
    ) -> str:
        """:meth:`register_function` with ``fn`` already serialized as ``code`` (the
        Executor serializes once, to find a function it registered by its digest)."""
        if group is not None:
            raise ValueError(
                "sharing a function with a Globus group is not supported here: share it "
                "with user ids (allowed_users=[...]) or with everyone (public=True)"
            )
        if ha_endpoint_id is not None:
            raise ValueError(
                "ha_endpoint_id is not supported: fxstream has no high-assurance endpoints; "
                "restrict who runs the function with allowed_users, and who runs on an "
                "endpoint with its allowed_functions"
            )
        if name is None:
            name = getattr(fn, "__name__", None) or type(fn).__name__
        if description is None:
            description = (inspect.getdoc(fn) or "")[:_DOCSTRING_CHARS]
        return self.register_code(
            code,
            name=name,
            container=container,
            public=public,
            allowed_users=allowed_users,
            description=description,
            metadata={
                **registration_metadata(),
                **{k: str(v) for k, v in (metadata or {}).items()},
            },
        )

    def register_code(
        self,
        code: bytes,
        *,
        name: str,
        container: str | None = None,
        public: bool = False,
        allowed_users: Iterable[str] = (),
        description: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Register a function already serialized with the code strategy; returns its id.

        What :meth:`register_function` does after serializing (the Executor
        serializes once to find a function it registered already by its digest).
        """
        body = {
            "name": name,
            "code": base64.b64encode(code).decode("ascii"),
            "container": container,
            "public": public,
            "allowed_users": list(allowed_users),
            "description": description,
            "metadata": dict(metadata or {}),
        }
        answer = self._rest.post("/functions", body)
        function_id = str(answer["function_id"])
        self._remember_digest(function_id, str(answer["code_sha256"]))
        return function_id

    def function_sha256(self, function_id: str) -> str:
        """The SHA-256 of ``function_id``'s registered code, which every task of it pins.

        Known for the functions this client registered; asked from the service once for
        any other (``GET /v1/functions/{id}``). The router refuses a task whose digest is
        not the registered code's (the function changed), and the endpoint checks the
        code it runs against it.
        """
        with self._lock:
            known = self._digests.get(function_id)
        if known is not None:
            return known
        self._require_token()
        record: dict[str, Any] = self._rest.get(f"/functions/{function_id}")
        digest = str(record["code_sha256"])
        self._remember_digest(function_id, digest)
        return digest

    def pin_function(self, function_id: str, sha256: str) -> None:
        """Pin the code digest the tasks of ``function_id`` carry, instead of asking the
        service (e.g. code you have read and hashed yourself: ``code_sha256(code)``).

        A task pinned to a digest the registered code no longer has is refused by the
        router (``TaskRejected``: the function changed), never run with other code.
        """
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"{sha256!r} is not a hex SHA-256 (64 characters 0-9a-f)")
        self._remember_digest(function_id, sha256)

    def _remember_digest(self, function_id: str, digest: str) -> None:
        with self._lock:
            self._digests[function_id] = digest
            if len(self._digests) > _DIGESTS_KEPT:
                del self._digests[next(iter(self._digests))]

    def get_function(self, function_id: str) -> dict[str, Any]:
        """The function record (``GET /v1/functions/{id}``), with ``code`` as bytes."""
        record: dict[str, Any] = self._rest.get(f"/functions/{function_id}")
        if isinstance(record.get("code"), str):
            record["code"] = base64.b64decode(record["code"])
        return record

    def list_functions(self) -> list[dict[str, Any]]:
        """The functions the caller may run: own, public and shared (without code)."""
        answer: list[dict[str, Any]] = self._rest.get("/functions")
        return answer

    def delete_function(self, function_id: str) -> None:
        """Delete a function you own."""
        self._rest.delete(f"/functions/{function_id}")

    # --- endpoints ---------------------------------------------------------------------

    def register_endpoint(
        self,
        name: str,
        *,
        public: bool = False,
        allowed_users: Iterable[str] = (),
        description: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Register an endpoint (the service creates its queue topic); returns its id."""
        body = {
            "name": name,
            "public": public,
            "allowed_users": list(allowed_users),
            "description": description,
            "metadata": dict(metadata or {}),
        }
        answer = self._rest.post("/endpoints", body)
        return str(answer["endpoint_id"])

    def list_endpoints(self) -> list[dict[str, Any]]:
        """The endpoints the caller may use, each with its live ``status``."""
        answer: list[dict[str, Any]] = self._rest.get("/endpoints")
        return answer

    def get_endpoints(self, role: str | None = None) -> list[dict[str, Any]]:
        """Globus Compute's name for the endpoints you may use: ``role="owner"`` (its
        default when unset) those you own, ``"any"`` also the public and shared ones;
        each with its live ``status``."""
        if role not in (None, "owner", "any"):
            raise ValueError(f"role must be 'owner' or 'any', not {role!r}")
        endpoints = self.list_endpoints()
        if role == "any":
            return endpoints
        me = self.user_id
        return [e for e in endpoints if e.get("owner_id") == me]

    def get_endpoint_logs(
        self,
        endpoint_id: str,
        *,
        limit: int = 200,
        level: str = "INFO",
        since: float | None = None,
    ) -> dict[str, Any]:
        """The newest ``limit`` lines an endpoint's agents logged (at or above ``level``,
        after ``since``), oldest first: ``{"lines": [{"at", "level", "logger", "message",
        "agent_id", "hostname"}], "dropped", "scanned", "complete"}``. Only the endpoint's
        owner may read them (``PermissionDenied`` for a user it is shared with)."""
        query = urlencode(
            {"limit": limit, "level": level, **({} if since is None else {"since": since})}
        )
        answer: dict[str, Any] = self._rest.get(f"/endpoints/{endpoint_id}/logs?{query}")
        return answer

    def get_endpoint_metadata(self, endpoint_id: str) -> dict[str, Any]:
        """An endpoint's record (Globus Compute's name for :meth:`get_endpoint`): name,
        owner, description, ``metadata`` labels and live ``status``, with the endpoint's id
        also under ``uuid``, Globus Compute's key for it."""
        record = dict(self.get_endpoint(endpoint_id))
        record.setdefault("uuid", record.get("endpoint_id", endpoint_id))
        return record

    def get_worker_hardware_details(self, endpoint_id: str) -> str:
        """Run a task on ``endpoint_id`` that reports its worker's hardware (CPU, memory,
        host, Python); returns the task id, whose result (``get_result``) is that report
        as text, as in Globus Compute."""
        function_id = self.register_function(hardware_report)
        return self.run(endpoint_id=endpoint_id, function_id=function_id)

    def version_check(self, endpoint_version: str | None = None) -> None:
        """Raise :class:`~fxstream.sdk.errors.VersionMismatch` when this SDK's (or
        ``endpoint_version``'s) version is not the service's: the wire contract is
        versioned with the platform (``GET /v1/version``)."""
        answer: dict[str, Any] = self._rest.get("/version")
        check_versions(answer, endpoint_version)

    def logout(self) -> None:
        """Forget this client's API token here, as Globus Compute's ``logout`` removes
        its stored login. To end the token itself, :meth:`revoke_token` first; the
        credentials file is left alone (it is yours to delete)."""
        self._token = None
        self._rest.set_token(None)

    def get_endpoint(self, endpoint_id: str) -> dict[str, Any]:
        """One endpoint's record with its live ``status``."""
        answer: dict[str, Any] = self._rest.get(f"/endpoints/{endpoint_id}")
        return answer

    def get_endpoint_status(self, endpoint_id: str) -> dict[str, Any]:
        """One endpoint's live status: ``state`` (online, lost, never-seen), workers, queue,
        and Globus Compute's ``status`` (``online``, else ``offline``)."""
        status: dict[str, Any] = dict(self.get_endpoint(endpoint_id)["status"])
        status["status"] = "online" if status.get("state") == "online" else "offline"
        return status

    def delete_endpoint(self, endpoint_id: str) -> None:
        """Delete an endpoint you own."""
        self._rest.delete(f"/endpoints/{endpoint_id}")

    # --- trigger rules -----------------------------------------------------------------

    def register_trigger(
        self,
        *,
        source: str,
        function_id: str,
        endpoint_id: str,
        name: str | None = None,
        endpoint_group: Iterable[str] | None = None,
        event_type: str | None = None,
        key_pattern: str = "*",
        predicates: Iterable[Predicate] = (),
        arguments: str = "event",
        template: Mapping[str, str] | None = None,
        constants: Mapping[str, Any] | None = None,
        paused: bool = False,
        max_in_flight: int | None = None,
        max_per_second: float | None = None,
    ) -> str:
        """Register a trigger rule: each event on ``events.<source>`` that passes the filter
        runs ``function_id`` on ``endpoint_id`` (or any endpoint of ``endpoint_group``) as
        you; returns the rule id (docs/triggers.md).

        The filter: ``event_type`` (exact), ``key_pattern`` (``fnmatch`` on the event key)
        and ``predicates`` on the event's attributes, each ``(attribute, op, value)`` or a
        mapping with those keys; ``op`` is one of ``eq``, ``ne``, ``prefix``, ``suffix``,
        ``glob``, ``lt``, ``le``, ``gt``, ``ge``, ``exists``. ``arguments`` says how the
        event becomes keyword arguments: ``event`` (one argument ``event``, a dict),
        ``attributes`` (one per attribute) or ``template`` (``template`` maps argument
        names to ``event_key``, ``source``, ``event_type``, ``occurred_at``,
        ``attributes`` or ``attributes.<name>``); ``constants`` are added to every call.
        ``max_in_flight`` and ``max_per_second`` limit the rule: events beyond them wait
        on their topic. The rule's tasks form the task group whose id is the rule id.
        """
        info = client_info()
        body = {
            "name": name or f"{source}-trigger",
            "source": source,
            "function_id": function_id,
            "endpoint_id": endpoint_id,
            "endpoint_group": None if endpoint_group is None else list(endpoint_group),
            "event_type": event_type,
            "key_pattern": key_pattern,
            "predicates": [_predicate(p) for p in predicates],
            "arguments": arguments,
            "template": dict(template or {}),
            "constants": dict(constants or {}),
            "paused": paused,
            "max_in_flight": max_in_flight,
            "max_per_second": max_per_second,
            "client": {
                "python_version": info.python_version,
                "fxstream_version": info.fxstream_version,
                "serializers": dict(info.serializers),
            },
        }
        answer = self._rest.post("/triggers", body)
        return str(answer["rule_id"])

    def list_triggers(self) -> list[dict[str, Any]]:
        """Your trigger rules, oldest first."""
        answer: list[dict[str, Any]] = self._rest.get("/triggers")
        return answer

    def get_trigger(self, rule_id: str) -> dict[str, Any]:
        """One of your rules with its ``status``: ``fired``, ``in_flight``, ``states`` (count
        per task state) and ``waiting`` (events of its source not yet processed)."""
        answer: dict[str, Any] = self._rest.get(f"/triggers/{rule_id}")
        return answer

    def pause_trigger(self, rule_id: str) -> dict[str, Any]:
        """Pause one of your rules: events processed while it is paused fire nothing."""
        answer: dict[str, Any] = self._rest.post(f"/triggers/{rule_id}/pause", None)
        return answer

    def resume_trigger(self, rule_id: str) -> dict[str, Any]:
        """Resume one of your rules: it fires again for events processed from now on."""
        answer: dict[str, Any] = self._rest.post(f"/triggers/{rule_id}/resume", None)
        return answer

    def delete_trigger(self, rule_id: str) -> None:
        """Delete one of your rules (its tasks stay)."""
        self._rest.delete(f"/triggers/{rule_id}")

    # --- analytics -----------------------------------------------------------------------

    def get_analytics(
        self,
        dimension: str = "user",
        *,
        key: str | None = None,
        window: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Windowed aggregates of your tasks (``GET /v1/analytics``), oldest window first.

        ``dimension``: ``user`` (all your tasks), ``function``, ``endpoint`` or ``rule``
        (per id; ``key`` picks one); ``window``: ``tumbling`` or ``hopping`` (both by
        default). Each window holds ``finished``, ``succeeded``, ``failed``,
        ``cancelled``, ``rejected``, ``errors``, ``error_rate``, ``finished_per_s``,
        ``states`` and ``latency_s`` (``p50``, ``p90``, ``p99``, ``max``, ``mean``).
        """
        params: list[tuple[str, str]] = [("dimension", dimension), ("limit", str(limit))]
        for name, value in (("key", key), ("window", window)):
            if value is not None:
                params.append((name, value))
        for name, moment in (("since", since), ("until", until)):
            if moment is not None:
                params.append((name, repr(float(moment))))
        page: dict[str, Any] = self._rest.get(f"/analytics?{urlencode(params)}")
        windows: list[dict[str, Any]] = page.get("windows", [])
        return windows


def _predicate(predicate: Predicate) -> dict[str, Any]:
    if isinstance(predicate, Mapping):
        return dict(predicate)
    if isinstance(predicate, tuple) and len(predicate) in (2, 3):
        attribute, op, *value = predicate
        return {"attribute": attribute, "op": op, "value": value[0] if value else None}
    raise ValueError(
        f"a predicate is (attribute, op, value) or a mapping with those keys, not {predicate!r}"
    )
