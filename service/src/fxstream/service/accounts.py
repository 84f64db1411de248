"""Kafka principals for users, endpoints and the service, made through the Admin API.

Registering a user creates its SCRAM-SHA-512 credential (``u.<U>``), its ACLs and its two
topics (``from.user.<U>``, ``results.<U>``); registering an endpoint likewise
(``ep.<E>``: ``tasks.ep.<E>``, ``from.ep.<E>``). Deleting removes the credential first (no new
login), then every ACL of the principal, then the topics. The ACLs are exactly the rows of
:mod:`fxstream.topics.acls`, the one table. Every step is idempotent, so a registration that
failed half-way is completed by running it again.

The password is generated here, returned once in a :class:`Principal` and kept nowhere: Kafka
stores only a salted SCRAM hash. The manager must connect as the platform's admin (the only
principal allowed to alter credentials and ACLs): :meth:`AccountManager.connect`, or the REST
API's own admin client. On the insecure development platform
(PLAINTEXT, no authorizer) only the topics are made and no credential is returned.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)

from fxstream.topics import Catalogue, KafkaConnection, ProvisionError, TopicSpec, ensure_topics
from fxstream.topics.acls import (
    SERVICE_USERNAME,
    Role,
    binding_filters_for,
    bindings_for,
    every_acl,
    username_for,
)

__all__ = ["SCRAM_ITERATIONS", "AccountError", "AccountManager", "Principal"]

# Kafka's minimum for SCRAM-SHA-512 is 4096; the cost is paid once per connection.
SCRAM_ITERATIONS = 8192
_PASSWORD_BYTES = 32
_USER_TOPICS = ("from.user.{user_id}", "results.{user_id}")
_ENDPOINT_TOPICS = ("tasks.ep.{endpoint_id}", "from.ep.{endpoint_id}")
_SOURCE_TOPICS = ("events.{source}",)


class AccountError(RuntimeError):
    """Kafka refused or did not answer a step of creating or deleting a principal."""


@dataclass(frozen=True)
class Principal:
    """A principal just created: its username and (once, never stored) its password.

    ``password`` is None on the insecure development platform, which has no credentials.
    """

    role: Role
    principal_id: str | None
    username: str
    password: str | None = field(default=None, repr=False)

    def connection(self, base: KafkaConnection) -> KafkaConnection:
        """``base``'s brokers and CA, as this principal (``base`` itself when insecure)."""
        if self.password is None or not base.secure:
            return base
        return base.as_user(self.username, self.password)


class AccountManager:
    """Creates and deletes principals, their ACLs and their topics, as the admin."""

    def __init__(
        self,
        admin: AdminClient,
        catalogue: Catalogue,
        *,
        secure: bool | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._admin = admin
        self._catalogue = catalogue
        self._timeout_s = timeout_s
        self._secure = secure

    @classmethod
    def connect(
        cls, kafka: KafkaConnection, catalogue: Catalogue, *, timeout_s: float = 30.0
    ) -> AccountManager:
        """A manager with its own admin client on ``kafka`` (which must be the admin)."""
        admin = AdminClient({**kafka.confluent(), "log_level": 2})
        return cls(admin, catalogue, secure=kafka.secure, timeout_s=timeout_s)

    @property
    def secure(self) -> bool:
        """False on the insecure development platform: topics only, no credentials or ACLs.

        Unless given, found out once by asking the broker for ACLs: one without an
        authorizer answers SECURITY_DISABLED.
        """
        if self._secure is None:
            everything = every_acl()
            try:
                self._admin.describe_acls(everything, request_timeout=self._timeout_s).result(
                    timeout=self._timeout_s
                )
                self._secure = True
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if (
                    not isinstance(error, KafkaError)
                    or error.code() != KafkaError.SECURITY_DISABLED
                ):
                    raise AccountError(
                        f"cannot tell whether Kafka enforces ACLs: {exc}; check that the "
                        "platform is up"
                    ) from exc
                self._secure = False
        return self._secure

    # --- users and endpoints -------------------------------------------------------------

    def create_user_principal(self, user_id: str) -> Principal:
        """User ``user_id``'s topics, ACLs and SCRAM credential; the password is returned once."""
        return self._create(Role.USER, user_id, self._topics(_USER_TOPICS, user_id=user_id))

    def create_endpoint_principal(self, endpoint_id: str) -> Principal:
        """Endpoint ``endpoint_id``'s topics, ACLs and credential; the password is returned once."""
        topics = self._topics(_ENDPOINT_TOPICS, endpoint_id=endpoint_id)
        return self._create(Role.ENDPOINT, endpoint_id, topics)

    def create_endpoint_principals(self, endpoint_ids: Sequence[str]) -> list[Principal]:
        """:meth:`create_endpoint_principal` for many endpoints at once, in their order: one
        Admin API call per step for all of them (topics, ACLs, credentials), where one call
        per endpoint would cost a full topic listing each (``./fx bench service-scale``
        registers thousands this way)."""
        wanted = [
            (
                endpoint_id,
                username_for(Role.ENDPOINT, endpoint_id),
                self._topics(_ENDPOINT_TOPICS, endpoint_id=endpoint_id),
            )
            for endpoint_id in endpoint_ids
        ]
        return self._create_many(Role.ENDPOINT, wanted) if wanted else []

    def delete_user_principal(self, user_id: str) -> None:
        """Remove user ``user_id``'s credential, ACLs and topics (what is already gone is fine)."""
        self._delete(Role.USER, user_id, self._topics(_USER_TOPICS, user_id=user_id))

    def delete_endpoint_principal(self, endpoint_id: str) -> None:
        """Remove endpoint ``endpoint_id``'s credential, ACLs and topics (queued tasks too)."""
        topics = self._topics(_ENDPOINT_TOPICS, endpoint_id=endpoint_id)
        self._delete(Role.ENDPOINT, endpoint_id, topics)

    def create_source_principal(self, source: str) -> Principal:
        """Event source ``source``'s topic ``events.<source>``, ACLs and credential; the
        password is returned once."""
        return self._create(Role.SOURCE, source, self._topics(_SOURCE_TOPICS, source=source))

    def delete_source_principal(self, source: str) -> None:
        """Remove event source ``source``'s credential, ACLs and its events topic."""
        self._delete(Role.SOURCE, source, self._topics(_SOURCE_TOPICS, source=source))

    # --- the service ---------------------------------------------------------------------

    def ensure_service_principal(self, username: str = SERVICE_USERNAME) -> Principal:
        """The ``fxstream-service`` principal with the table's ACLs and a new password.

        Run at platform bootstrap; every run sets a fresh password (the previous one stops
        working for new connections), so write the returned one to the service's 0600
        credentials file before starting the service. ``username`` other than the default
        is for tests, which must not change the running platform's service password.
        """
        return self._create(Role.SERVICE, None, {}, username=username)

    def delete_service_principal(self, username: str = SERVICE_USERNAME) -> None:
        """Remove a service principal's credential and ACLs."""
        self._delete(Role.SERVICE, None, {}, username=username)

    # --- steps ---------------------------------------------------------------------------

    def _topics(self, names: tuple[str, ...], **template: str) -> dict[str, TopicSpec]:
        specs = [self._catalogue.spec(name) for name in names]
        return {self._catalogue.topic(spec, **template): spec for spec in specs}

    def _create(
        self,
        role: Role,
        principal_id: str | None,
        topics: Mapping[str, TopicSpec],
        *,
        username: str | None = None,
    ) -> Principal:
        # Validates the id before anything is made.
        username = username or username_for(role, principal_id)
        return self._create_many(role, [(principal_id, username, topics)])[0]

    def _create_many(
        self,
        role: Role,
        wanted: Sequence[tuple[str | None, str, Mapping[str, TopicSpec]]],
    ) -> list[Principal]:
        """Each ``(principal_id, username, topics)``'s topics, then all their ACLs, then
        all their credentials: one Admin API call per step for the lot."""
        names = [username for _, username, _ in wanted]
        what = names[0] if len(names) == 1 else f"{len(names)} principals ({names[0]}, ...)"
        topics = {name: spec for _, _, own in wanted for name, spec in own.items()}
        if topics:
            try:
                ensure_topics(self._admin, self._catalogue, topics, timeout_s=self._timeout_s)
            except (ProvisionError, KafkaException) as exc:
                raise AccountError(f"cannot create the topics of {what}: {exc}") from exc
        if not self.secure:
            return [Principal(role, pid, username) for pid, username, _ in wanted]
        # The rights before the credential: a principal that can log in has its ACLs.
        bindings = [
            binding
            for pid, username, _ in wanted
            for binding in bindings_for(role, self._catalogue, pid, username=username)
        ]
        if bindings:
            self._wait(
                self._admin.create_acls(bindings, request_timeout=self._timeout_s),
                f"create the ACLs of {what}",
            )
        made: list[Principal] = []
        upserts: list[UserScramCredentialAlteration] = []
        for pid, username, _ in wanted:
            password = secrets.token_urlsafe(_PASSWORD_BYTES)
            upserts.append(
                UserScramCredentialUpsertion(
                    username,
                    ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS),
                    password.encode(),
                )
            )
            made.append(Principal(role, pid, username, password))
        self._wait(
            self._admin.alter_user_scram_credentials(upserts, request_timeout=self._timeout_s),
            f"set the SCRAM credential of {what}",
        )
        return made

    def _delete(
        self,
        role: Role,
        principal_id: str | None,
        topics: Mapping[str, TopicSpec],
        *,
        username: str | None = None,
    ) -> None:
        username = username or username_for(role, principal_id)
        if self.secure:
            deletion = UserScramCredentialDeletion(username, ScramMechanism.SCRAM_SHA_512)
            self._wait(
                self._admin.alter_user_scram_credentials(
                    [deletion], request_timeout=self._timeout_s
                ),
                f"delete the SCRAM credential of {username}",
                gone_ok=(KafkaError.RESOURCE_NOT_FOUND,),
            )
            self._wait(
                self._admin.delete_acls(
                    binding_filters_for(role, principal_id, username=username),
                    request_timeout=self._timeout_s,
                ),
                f"delete the ACLs of {username}",
            )
        if topics:
            self._wait(
                self._admin.delete_topics(list(topics), request_timeout=self._timeout_s),
                f"delete the topics of {username}",
                gone_ok=(KafkaError.UNKNOWN_TOPIC_OR_PART,),
            )

    def _wait(
        self,
        futures: Mapping[Any, Future[Any]],
        what: str,
        *,
        gone_ok: tuple[int, ...] = (),
    ) -> None:
        """Wait for every future of one Admin API call; raise :class:`AccountError` if any
        failed (errors whose code is in ``gone_ok`` mean the thing was already absent)."""
        for future in futures.values():
            try:
                future.result(timeout=self._timeout_s)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError) and error.code() in gone_ok:
                    continue
                raise AccountError(
                    f"cannot {what}: {exc}; check that the platform is up and that this "
                    "process connects as the platform's admin"
                ) from exc
            except TimeoutError as exc:
                raise AccountError(
                    f"cannot {what}: Kafka did not answer within {self._timeout_s:g}s; "
                    "check that the platform is up"
                ) from exc
